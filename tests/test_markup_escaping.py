"""#40 finding 8: a module name is markup's data, never markup. torch refuses only "." in a module name, so
``head" onmouseover="alert(1)" x="`` is a valid child name; every attribute it reaches must hold it as a value."""
from __future__ import annotations

from html.parser import HTMLParser

import torch
from dashboard_helpers import every_step_dashboard

PAYLOAD = 'head" onmouseover="alert(1)" x="'


class _Attrs(HTMLParser):
    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.attrs: list[tuple[str, str, str | None]] = []

    def handle_starttag(self, tag, attrs):
        self.attrs.extend((tag, k, v) for k, v in attrs)

    handle_startendtag = handle_starttag


def attrs_of(markup: str) -> list[tuple[str, str, str | None]]:
    parser = _Attrs()
    parser.feed(markup)
    parser.close()
    return parser.attrs


def assert_payload_is_data(markup: str, where: str) -> None:
    attrs = attrs_of(markup)
    handlers = [(t, k) for t, k, _ in attrs if k.lower().startswith("on")]
    assert handlers == [], f"{where}: live event handler attribute(s) {handlers}"
    assert not any(k == "x" for _, k, _ in attrs), f"{where}: the payload closed its attribute"
    assert any(v is not None and PAYLOAD in v for _, _, v in attrs), f"{where}: the payload is not an attribute value"


class PayloadNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.add_module(PAYLOAD, torch.nn.Linear(8, 1))

    def forward(self, x):
        return getattr(self, PAYLOAD)(torch.relu(self.body(x)))


def test_sparkline_aria_label_holds_the_name_as_a_value():
    from nbguard.notebook.widgets.sparkline import sparkline_svg

    assert_payload_is_data(sparkline_svg([1.0, 2.0, float("nan")], label=PAYLOAD), "sparkline")


def test_dashboard_layer_view_of_a_module_named_with_markup():
    import nbguard

    model = PayloadNet()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(0))
    with nbguard.watch(model, optimizer=opt) as watch:
        dash = every_step_dashboard(watch)
        for _ in range(3):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
        dash.finish()
    assert dash.errors == []
    group = next(g for g in dash.layer.options if PAYLOAD in g)
    dash.layer.value = group
    assert_payload_is_data(dash.layer_view.value, "layer view")
    for markup in (dash.sparks.value, dash.status.value):
        assert not [(t, k) for t, k, _ in attrs_of(markup) if k.lower().startswith("on")]
    # the static HTML of the same watch (the notebook's saved output, the report) holds it as text too
    bundle = watch._repr_mimebundle_()
    page = bundle[0]["text/html"] if isinstance(bundle, tuple) else bundle["text/html"]
    assert not [(t, k) for t, k, _ in attrs_of(page) if k.lower().startswith("on")]
