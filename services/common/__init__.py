"""What the frontend and the worker share, torch-free: the request's checked sampling options
(`sampling`) and limits (`limits`), the Worker contract's conversions (`wire`), and the default model's
folder (`default_model`, converted by `convert_gguf` in a child process)."""
