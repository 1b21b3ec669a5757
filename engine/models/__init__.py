"""Llama-family models: ``spec`` (config parsing), ``llama`` (the decoder), ``loader`` (safetensors),
``rope``, ``attention`` (paged attention + the device's KV ops), ``kernel_ops`` (the Protocols those ops
modules implement), ``tiny`` and ``tokenizer_build`` (the offline default model)."""
