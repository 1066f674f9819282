# The processor image (also runs the ONNX Runtime server and the simulators in the CPU profile).
FROM python:3.11-slim
WORKDIR /app
COPY pyproject.toml README.md ./
COPY extproc ./extproc
COPY backends ./backends
COPY canary ./canary
COPY ebpf ./ebpf
COPY examples ./examples
RUN pip install --no-cache-dir '.[ort,sim]' \
    && python -m extproc.intent.train  # the task-intent classifier, built from the shipped set (docs/intent.md)
EXPOSE 50051 50052 9902
CMD ["adapterctl", "serve", "/etc/adapter/gateway.yaml"]
