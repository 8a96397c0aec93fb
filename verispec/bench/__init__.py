"""``verispec bench``: speculative decoding measured against plain decoding on prompt sets, and
the table, plot and machine line the benchmark scripts share. Above ``engine/`` (it drives
``LLM``); nothing in the engine imports it."""
