"""Llama-family models: ``spec`` (config parsing), ``llama`` (the decoder), ``loader`` (safetensors),
``rope``, ``attention`` (paged attention + the device's KV ops), ``tiny`` and ``tokenizer_build``
(the offline default model)."""
