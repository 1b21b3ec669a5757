"""``prefixgate bench``: replay multi-tenant traces against gateways (``replay``; traces in ``traces``)."""
