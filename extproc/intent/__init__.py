"""Task intent of a request: the `x-task-intent` header, else a small ONNX text classifier (docs/intent.md).

`classifier` needs nothing beyond the standard library to import (onnxruntime and numpy, the `[ort]`
extra, only when a model is loaded); `train` is the build step and needs numpy and onnx.
"""
