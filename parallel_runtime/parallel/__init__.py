"""Applying the plans to one forward on one rank: context parallel (attention, sequence splits), CFG, tensor-parallel hooks, VAE bands, compiled regions."""
