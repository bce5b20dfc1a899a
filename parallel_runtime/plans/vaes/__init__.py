"""The VAEs Shard VAE splits into row bands, one file per VAE family (``vocabulary/vae.py`` says
what a VAE plan names). Nothing is imported here: the registry (``plans/__init__.py``) lists them."""
