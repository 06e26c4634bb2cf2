"""Remote reward models: the transport to OpenAI-compatible endpoints (a vLLM/SGLang server, a hosted API).

:mod:`~verl_async_rm.remote.limits` holds the job-wide request, token and concurrency limits;
:mod:`~verl_async_rm.remote.endpoints` the HTTP client over one or several base URLs (retries with bounded waits,
least-outstanding routing, cool-down of failing endpoints, the API key kept to the configured hosts)."""
