"""Tenants, API keys, quotas, envelope encryption, usage ledger and reports.

The gateway uses ``tenancy.service`` only (``TenancyService`` and the types it re-exports). Inside:

    service    the facade: authenticate, scope_for, admit, price, record_usage, usage, admin calls
    types      TenantContext (an engine TenantScope), UsageRecord, Price, Quotas, ...
    errors     AuthenticationError, QuotaExceededError, ... (each with .status and .code)
    database   the store interface (a Protocol) and the database URL (SQLite file or PostgreSQL)
    db         SQLite (WAL) implementation and its numbered migrations (the embedded default)
    pg_store   PostgreSQL implementation (psycopg 3) and its numbered migrations (a fleet)
    store      tenant / key / data-key rows
    keys       API key format, peppered hashes, the server secret
    namespace  server-derived cache namespaces per share scope
    crypto     KEK, wrapped per-tenant data keys, TenantCipher (the engine's BlockCipher)
    quota      rpm/tpm token buckets and the budget check
    shared_limits  the same buckets, spend counters and revocation broadcast on Redis (a fleet)
    pricing    litellm's bundled cost map
    ledger     the batched usage writer thread
    report     usage reports: table, csv, json, html
"""
