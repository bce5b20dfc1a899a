"""The text encoders Shard Text Encoder splits (ComfyUI's own, in ``comfy/text_encoders/``), one file
per encoder family (``vocabulary/text_encoder.py`` says what they share). Nothing is imported here:
the registry (``plans/__init__.py``) lists them."""
