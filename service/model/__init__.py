"""The model layer: the shared layers the forward passes are built from (``layers``, which imports
JAX: never import it here)."""
