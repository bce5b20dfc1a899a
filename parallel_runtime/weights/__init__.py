"""A rank's weights: where they come from in ComfyUI, how tensor parallelism cuts them (plain, quantized, GGUF, LoRA patches) and how they travel (pickling, byte streams)."""
