"""
server/app.py: PersuArena as an OpenEnv environment package's server (openenv.yaml: app
server.app:app), what `openenv validate .`, `uvicorn server.app:app` and the Dockerfile run.
The server is lab/env_server.py's (WebSocket sessions at /ws, many on one batched persuadee);
this file only names it the way OpenEnv's packages do.

    python -m server.app --port 8000 --persuadee smollm2      # main(): env_server's flags
    PERSUARENA_ARGS="--persuadee smollm2 --scenarios heldout" uvicorn server.app:app --port 8000

`app` builds the server on its first event (uvicorn's startup), its flags from PERSUARENA_ARGS
(lab/env_server.py's, defaults otherwise), so importing this file loads no model.
"""
import os
import shlex
import sys

from lab import env_server


class LazyApp:
    """An ASGI app that builds env_server's app from PERSUARENA_ARGS on its first call."""

    def __init__(self):
        self.app = None

    async def __call__(self, scope, receive, send):
        if self.app is None:
            argv = ["--serve", *shlex.split(os.environ.get("PERSUARENA_ARGS", ""))]
            self.app = env_server.serving_app(env_server.parse_args(argv))
        return await self.app(scope, receive, send)


app = LazyApp()


def main(argv=None):
    """`python -m server.app [env_server's flags]`: serve, as python -m lab.env_server --serve."""
    env_server.main(["--serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    main()
