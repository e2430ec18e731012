"""The backend-agnostic engine: executor contract, KV pool, scheduler."""
