"""Tenants, API keys, quotas, envelope encryption, usage ledger and reports."""
