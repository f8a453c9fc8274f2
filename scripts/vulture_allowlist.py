"""Names vulture reports as unused in agent/ that are used, where it cannot see (scripts/test runs vulture with this).

Each line says who uses the name. Add a line only with that reason; remove what is really unused instead.
"""
# ruff: noqa: B018, F821

_.collect  # prometheus_client calls a custom collector's collect()
_.error  # argparse calls ArgumentParser.error() (options._Parser: one-line errors)
_.all_labels  # MetricSpec.all_labels: tests/test_metric_names.py checks the docs' label columns with it
_.identified_by  # GpuBudget.identified_by: how vLLM's processes were told apart (pid, elimination, none); tests
_.starts  # StartupFigures.starts: how many vLLM starts the log showed; tests/test_vllm_log.py
_.open_connections  # ConnectionGuard.open_connections: tests/test_listener.py checks the cap with it
_.repeated  # LogRecord.repeated (log.OncePerCause): structlog's ExtraAdder puts it in the JSON line
parse_metrics  # vllm_metrics.parse.parse_metrics (a string body): the tests' and the differential test's entry point
select_lines_plainly  # vllm_metrics.select.select_lines_plainly: the selection's definition (tests)
parse_metrics_body  # vllm_metrics.stream.parse_metrics_body: MetricsStream over bytes in hand; the tests' entry point
build_registry  # exposition.render.build_registry: the whole exposition, what RenderCache is held to; tests, bench
_.can_write_eof  # TlsTransport.can_write_eof: asyncio.Transport's interface (aiohttp's writer may ask)
_.set_protocol  # TlsTransport.set_protocol: asyncio.Transport's interface
_.get_protocol  # TlsTransport.get_protocol: asyncio.Transport's interface
