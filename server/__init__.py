"""server: PersuArena's OpenEnv environment package entry point (server/app.py; openenv.yaml at
the repository root names it). The server itself is lab/env_server.py."""
