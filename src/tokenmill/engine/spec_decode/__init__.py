"""Speculative decoding: proposers guess the next tokens, one target forward verifies them.

    config.py       SpeculativeConfig (method, number of tokens, n-gram window, draft model)
    proposer.py     the Proposer protocol
    ngram.py        prompt lookup: what followed the last n tokens earlier in the sequence
    draft_model.py  a draft model (a smaller checkpoint, or the target's first layers)
    rejection.py    exact verification inside the sampler: accept while the target agrees
    policy.py       how many tokens each request speculates this step (acceptance, cost)
"""
