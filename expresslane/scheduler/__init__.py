"""The scheduler tier (torch-free): requests and their KV blocks, the step policy, the
continuous scheduler and the static/dynamic ones, and speculative decoding's bookkeeping.
The engine drives it; it imports only the leaf modules."""
