"""OPS ARTIFACTS: Grafana dashboards built with grafanalib from the rules' parameter file;
the committed JSON is generated from these sources (`mscale dashboards export`).

Runs in the CLI only. May import: rules, textfile.
"""
