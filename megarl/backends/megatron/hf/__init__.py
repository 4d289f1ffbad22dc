"""Hugging Face files and names seen from the Megatron backend.

- `hf_io`: read and write safetensors model directories (streamed, written atomically);
- `mapping`: Hugging Face tensor names and layouts to Megatron's and back (pure);
- `live`: a running model's weights in Hugging Face form (export, load, stream for the
  weight sync);
- `model_config`: config.json read into `ModelArgs`, and the TP×PP layout rule.

The converter (`megarl.convert`) builds on these; they import nothing from it.
"""
