"""Quality harnesses over the whole engine (they drive LLM from outside, as a user would): sparse
decode's teacher-forced agreement with dense attention (sparse.py) and a quantization's agreement
and perplexity change against fp32 (quant.py). The tests and bench/ use them; nothing in the
engine imports them."""
