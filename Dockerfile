# genpool worker / Flower / gateway image (compose.yaml builds it once as genpool:latest).
FROM python:3.11-slim

# Triton compiles small C launchers when a kernel is first used: it needs a C compiler at run time.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*

WORKDIR /app
# torch first and pinned, as in the README (on Linux x86_64 this is the CUDA build).
RUN pip install --no-cache-dir torch==2.13.0
COPY pyproject.toml README.md ./
COPY .ci/constraints.txt .ci/constraints.txt
COPY engine engine
COPY kernels kernels
COPY workers workers
COPY producer producer
COPY schemas schemas
# Through the lock (.ci/constraints.txt): the image gets the same dependency set as CI.
RUN pip install --no-cache-dir -c .ci/constraints.txt '.[worker,convert,triton,gateway]'

# Unprivileged; the model cache volume (/cache) starts owned by this user.
RUN useradd --create-home --uid 10001 genpool && mkdir -p /cache/genpool \
 && chown -R genpool:genpool /cache
USER genpool
ENV GENPOOL_HOME=/cache/genpool PYTHONUNBUFFERED=1
CMD ["genpool", "--help"]
