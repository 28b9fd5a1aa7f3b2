"""Switchyard Kubernetes operator: the DecodeService CRD, node inventory, layout planner, renderer and
the kopf handlers that apply them. Imports nothing from the service but ``switchyard.service.modelspec``
and nothing from the kernels but their jax-free chooser, ``switchyard.kernels.selection`` (the operator
image carries no JAX)."""
