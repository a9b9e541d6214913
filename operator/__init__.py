"""The Kubernetes operator for TrainingJob resources (built on kopf).

Imported as ``flowmill.operator``; never as a bare ``operator``, which is the stdlib's.
"""
