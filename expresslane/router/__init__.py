"""``expresslane router``: one OpenAI-compatible endpoint in front of several replicas
(``expresslane serve`` processes), lane-aware (policy.py) and health-aware (app.py)."""
