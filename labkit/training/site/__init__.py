"""The folder `labkit watch` puts first on PYTHONPATH: its sitecustomize starts the agent in every rank."""
