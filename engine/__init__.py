"""Paged-KV inference engine: block pool, tenant-salted prefix index, scheduler, model runner, tiers."""
