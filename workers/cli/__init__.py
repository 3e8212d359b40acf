"""The `genpool` command: main.py dispatches (lazily, so producer commands need no torch),
worker.py runs a worker, models.py pulls checkpoints, demo.py is the one-command demo."""
