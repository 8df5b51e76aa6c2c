"""The router: the front door of a cluster of prefill and decode ranks (app.py), the rank
registry and load inquirer (workers.py), and the routing policies (policy.py)."""
