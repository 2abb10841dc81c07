"""Speculative decoding: proposers (n-gram lookup, a draft model), the acceptance rule, and the
per-request bookkeeping that decides who proposes how many tokens each step (docs/speculative.md).

The rest of the engine sees three things: `Request.spec_token_ids` (set before the scheduler runs,
verified in the step, cleared by the update), `Speculator.propose`/`observe`, and the runner's
acceptance rule (engine/spec/verify.py)."""
