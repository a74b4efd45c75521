# PersuArena's OpenEnv server in a container: `docker build -t persuarena .` then
# `docker run -p 8000:8000 persuarena` (OpenEnv's from_docker_image starts it the same way).
# The persuadee and the other flags of lab/env_server.py go in PERSUARENA_ARGS.
FROM python:3.11-slim
WORKDIR /app
COPY requirements.txt pyproject.toml ./
COPY . .
RUN pip install --no-cache-dir -r requirements.txt
ENV PERSUARENA_ARGS="--persuadee smollm2"
EXPOSE 8000
HEALTHCHECK CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health')"
CMD ["sh", "-c", "exec python -m server.app --host 0.0.0.0 --port 8000 $PERSUARENA_ARGS"]
