"""Switchyard Kubernetes operator: the DecodeService CRD, node inventory, layout planner, renderer and
the kopf handlers that apply them. Imports nothing from the service but ``switchyard.service.modelspec``
(the operator image carries no JAX)."""
