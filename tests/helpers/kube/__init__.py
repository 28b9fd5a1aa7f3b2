"""An in-process Kubernetes API server (kmock) and the operator harness around it."""
