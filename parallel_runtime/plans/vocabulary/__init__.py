"""The vocabulary plans are written in: the plan types (one per kind of model), what each says
(context-parallel splits and attention sites, tensor-parallel cuts, VAE row bands, model patches),
how the names a plan gives are found in a model (``matching``) and user plan files (``user``).
The declarations themselves are in ``plans/``; nothing here names a model family."""
