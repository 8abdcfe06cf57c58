"""The scheduler tier (torch-free): requests, KV blocks, policies, schedulers."""
