"""`tokenmill bench serve`: a load generator for any OpenAI-compatible server.

  workloads.py   what is sent: random token prompts, a ShareGPT file, synthetic multi-turn
                 chats sharing long system prompts
  client.py      one streaming request, timed on the client (TTFT, ITL, E2E, tokens)
  runner.py      the load loop: closed loop (concurrency) or open loop (Poisson/gamma rate)
  metrics.py     per-run summary: percentiles, throughput, goodput under SLOs
  report.py      the summary table
  sweep.py       a run per concurrency or rate, and the latency-vs-throughput plot
  tokenizer.py   the tokenizer used to build prompts and, without server usage, count tokens
"""
