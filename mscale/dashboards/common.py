"""Shared pieces of the dashboards: the datasource and node/job/GPU variables, selectors,
panel helpers and automatic layout. Thresholds come from mscale/rules/params.yaml."""

from __future__ import annotations

from dataclasses import dataclass, field

from grafanalib import core as g

DATASOURCE = "${datasource}"
ALL = ".*"


@dataclass
class Ctx:
    """What a dashboard module needs from params: selectors, windows, thresholds."""

    params: dict

    @property
    def agent(self) -> str:
        return self.params["selectors"]["agent"]

    def sel(self, *extra: str, node: bool = True, job: bool = False, gpu: bool = False) -> str:
        """A label selector with the agent's scrape job and the dashboard's variables."""
        parts = [self.agent]
        if node:
            parts.append('node=~"$node"')
        if job:
            parts.append('job_id=~"$job_id"')
        if gpu:
            parts.append('gpu=~"$gpu"')
        parts.extend(extra)
        return "{" + ",".join(parts) + "}"

    def window(self, name: str) -> str:
        return self.params["windows"][name]

    def alert(self, name: str) -> dict:
        return self.params["alerts"][name]

    def record(self, template: str) -> str:
        from mscale.rules.render import record_name

        return record_name(self.params, template)


def variables(ctx: Ctx, *, job: bool = False, gpu: bool = False) -> g.Templating:
    agent = ctx.agent
    out = [
        g.Template(name="datasource", label="Data source", query="prometheus", type="datasource", default="Prometheus"),
        _query_var("node", "Node", f"label_values(up{{{agent}}}, node)"),
    ]
    if job:
        out.append(
            _query_var("job_id", "Training job", f'label_values(mscale_job_up{{{agent},node=~"$node"}}, job_id)')
        )
    if gpu:
        out.append(
            _query_var("gpu", "GPU", f'label_values(mscale_gpu_temperature_celsius{{{agent},node=~"$node"}}, gpu)')
        )
    return g.Templating(list=out)


def _query_var(name: str, label: str, query: str) -> g.Template:
    return g.Template(
        name=name,
        label=label,
        query=query,
        dataSource=DATASOURCE,
        includeAll=True,
        multi=True,
        allValue=ALL,
        default="$__all",
        refresh=2,
        sort=1,
    )


def target(expr: str, legend: str = "") -> g.Target:
    return g.Target(expr=expr, legendFormat=legend, datasource=DATASOURCE)


@dataclass
class Panel:
    """A time series (or stat) panel before layout: width in grid units (24 per row)."""

    title: str
    targets: list[tuple[str, str]]
    unit: str = "short"
    description: str = ""
    width: int = 12
    height: int = 8
    threshold: float | None = None  # a red line (timeseries) or colour step (stat)
    threshold_below: bool = False  # red below the threshold instead of above
    kind: str = "timeseries"  # timeseries | stat
    min: float | None = None
    max: float | None = None
    stack: bool = False
    extra: dict = field(default_factory=dict)

    def build(self, grid: g.GridPos) -> g.Panel:
        targets = [target(expr, legend) for expr, legend in self.targets]
        steps = _threshold_steps(self.threshold, self.threshold_below)
        if self.kind == "stat":
            return g.Stat(
                title=self.title,
                description=self.description,
                dataSource=DATASOURCE,
                targets=targets,
                gridPos=grid,
                format=self.unit,
                reduceCalc="lastNotNull",
                graphMode="none",
                thresholds=steps or [{"color": "green", "value": None}],
            )
        return g.TimeSeries(
            title=self.title,
            description=self.description,
            dataSource=DATASOURCE,
            targets=targets,
            gridPos=grid,
            unit=self.unit,
            valueMin=self.min,
            valueMax=self.max,
            thresholds=steps or [{"color": "green", "value": None}],
            thresholdsStyleMode="line" if steps else "off",
            legendDisplayMode="table",
            legendPlacement="bottom",
            legendCalcs=["lastNotNull", "max"],
            tooltipMode="multi",
            tooltipSort="desc",
            stacking={"mode": "normal", "group": "A"} if self.stack else {"mode": "none", "group": "A"},
            extraJson=self.extra or None,
        )


Row = tuple[str, list[Panel]]  # a dashboard row: its title and its panels, left to right


def _threshold_steps(value: float | None, below: bool) -> list[dict]:
    if value is None:
        return []
    if below:
        return [{"color": "red", "value": None}, {"color": "green", "value": value}]
    return [{"color": "green", "value": None}, {"color": "red", "value": value}]


def dashboard(
    ctx: Ctx,
    *,
    uid: str,
    title: str,
    description: str,
    rows: list[Row],
    job: bool = False,
    gpu: bool = False,
) -> g.Dashboard:
    """Lay the rows out top to bottom, panels left to right, wrapping at 24 units."""
    panels: list[g.Panel] = []
    y = 0
    for row_title, row_panels in rows:
        panels.append(g.RowPanel(title=row_title, gridPos=g.GridPos(h=1, w=24, x=0, y=y)))
        y += 1
        x, row_h = 0, 0
        for p in row_panels:
            if x + p.width > 24:
                x, y = 0, y + row_h
                row_h = 0
            panels.append(p.build(g.GridPos(h=p.height, w=p.width, x=x, y=y)))
            x += p.width
            row_h = max(row_h, p.height)
        y += row_h
    dash = g.Dashboard(
        title=title,
        uid=uid,
        description=description,
        tags=["mscale"],
        panels=panels,
        templating=variables(ctx, job=job, gpu=gpu),
        refresh=ctx.params["dashboards"]["refresh"],
        time=g.Time(ctx.params["dashboards"]["time_from"], "now"),
        timezone="browser",
        graphTooltip=g.GRAPH_TOOLTIP_MODE_SHARED_CROSSHAIR,
        schemaVersion=36,
        links=[
            g.DashboardLink(
                title="mscale", type="dashboards", tags=["mscale"], asDropdown=True, keepTime=True, includeVars=True
            )
        ],
    )
    return dash.auto_panel_ids()
