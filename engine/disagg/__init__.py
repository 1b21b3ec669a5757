"""Prefill/decode disaggregation: KV blocks computed by a prefill engine move, verified, to a decode engine.

``api`` (public: the gateway imports it), ``wire`` (the chunk format and its MAC), ``transport``
(how chunks move: socket or CUDA IPC), ``receiver`` (the decode side's listener), ``node`` (the
engine-thread work on both sides and the ``DisaggEngine`` that serves a role). docs/disaggregation.md.
"""
