"""``jupyter nbconvert --to nbguard notebook.ipynb``: the nbguard outputs saved in a notebook,
collected into one report (self-contained HTML by default; ``--NbguardExporter.report_format``
md or json). JupyterLab lists it under "Save and Export Notebook As" (export_from_notebook).
The report is ``NAME.nbguard.html`` (``.nbguard.md``, ``.nbguard.json``): ``--to html`` writes ``NAME.html``
beside it, and one export must not overwrite the other.

Registered in pyproject.toml under ``[project.entry-points."nbconvert.exporters"]``.
"""
from __future__ import annotations

import json
from typing import Any

from nbconvert.exporters import Exporter
from traitlets import Bool, Unicode, default, observe

from ..document.codec import MAX_DEPTH, DocumentLimitError, check_limits, json_depth, load_document_text
from ..document.merge import merge_documents
from ..environment import environment_info
from ..findings import MIME_TYPE
from .report import Report

_EXTENSIONS = {"html": ".nbguard.html", "md": ".nbguard.md", "json": ".nbguard.json"}

_MIMETYPES = {"html": "text/html", "md": "text/markdown", "json": "application/json"}


def notebook_documents(nb: Any, refused: list[str] | None = None) -> list[dict]:
    """Every nbguard document in the outputs of ``nb``'s code cells, in notebook order. A document over
    the document limits (nbguard/document/codec.py) is left out, and ``refused`` gets a line naming the
    cell and the limit: one bad output must not stall or crash the export of the others."""
    docs = []
    for index, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        for output in cell.get("outputs", []):
            if output.get("output_type") not in ("display_data", "execute_result", "update_display_data"):
                continue
            data = (output.get("data") or {}).get(MIME_TYPE)
            try:
                if isinstance(data, str):  # some writers store JSON mime data as text
                    try:
                        data = load_document_text(data)
                    except json.JSONDecodeError:
                        continue
                elif isinstance(data, (dict, list)):
                    check_limits(data)
            except DocumentLimitError as exc:
                if refused is not None:
                    refused.append(f"An nbguard output of cell {index + 1} was not read: {exc}.")
                continue
            if isinstance(data, dict) and data.get("schema_version") is not None and "kind" in data:
                docs.append(data)
    return docs


def refuse_over_limit_outputs(nb: dict) -> list[str]:
    """Remove from a notebook's raw JSON (before nbformat turns it into nodes, recursively) every nbguard output
    over the document limits; one line per output removed, naming the cell and the limit."""
    refused = []
    for index, cell in enumerate(nb.get("cells") or []):
        for output in (cell.get("outputs") or []) if isinstance(cell, dict) else []:
            data = output.get("data") if isinstance(output, dict) else None
            if not isinstance(data, dict) or MIME_TYPE not in data:
                continue
            try:
                payload = data[MIME_TYPE]
                if isinstance(payload, str):
                    load_document_text(payload)
                else:
                    check_limits(payload)
            except DocumentLimitError as exc:
                del data[MIME_TYPE]
                refused.append(f"An nbguard output of cell {index + 1} was not read: {exc}.")
            except ValueError:  # text that is not JSON: notebook_documents skips it
                continue
    return refused


class NbguardExporter(Exporter):
    """Collects a notebook's nbguard outputs into one nbguard report."""

    export_from_notebook = "nbguard report"
    output_mimetype = "text/html"

    report_format = Unicode("html", help="Report format: html (self-contained), md or json.").tag(config=True)
    redact_home = Bool(True, help="Replace the home directory with ~ in the report.").tag(config=True)

    @default("file_extension")
    def _file_extension_default(self):
        return _EXTENSIONS.get(self.report_format, _EXTENSIONS["html"])

    @observe("report_format")
    def _report_format_changed(self, change):
        if change["new"] not in _EXTENSIONS:
            raise ValueError(f"NbguardExporter.report_format must be one of {', '.join(_EXTENSIONS)}, got {change['new']!r}")
        self.file_extension = _EXTENSIONS[change["new"]]
        self.output_mimetype = _MIMETYPES[change["new"]]

    def from_file(self, file_stream, resources=None, **kw):
        """The notebook read within the document limits: an nbguard output over them is dropped (and named in the
        report's notes) before nbformat builds its nodes, which recurse per level of nesting."""
        text = file_stream.read()
        try:
            raw = json.loads(text)
        except RecursionError:  # too deep for Python's parser: no part of it can be read
            raise DocumentLimitError(f"the notebook is nested {json_depth(text)} levels deep, too deep to parse: an "
                                     f"nbguard output in it is far over the limit of {MAX_DEPTH} levels (MAX_DEPTH); "
                                     "nothing was exported") from None
        refused = refuse_over_limit_outputs(raw) if isinstance(raw, dict) else []
        resources = dict(resources or {})
        resources["nbguard_refused"] = refused
        import nbformat

        return self.from_notebook_node(nbformat.reads(json.dumps(raw), as_version=4), resources=resources, **kw)

    def from_notebook_node(self, nb, resources=None, **kw):
        refused: list[str] = list((resources or {}).pop("nbguard_refused", None) or [])
        nb_copy, resources = super().from_notebook_node(nb, resources, **kw)
        name = (resources.get("metadata") or {}).get("name") or "notebook"
        docs = notebook_documents(nb_copy, refused)
        merged = merge_documents(docs, title=f"nbguard report: {name}")
        if not docs:
            merged["notes"] = [f"The notebook {name!r} has no saved nbguard outputs: run it with nbguard "
                               "(audit, watch, explained exceptions) and save it before exporting."]
        if refused:
            merged["notes"] = [*(merged.get("notes") or []), *refused]
        if "environment" not in merged:
            merged["environment"] = environment_info()
            merged.setdefault("notes", []).append(
                "The environment below is the one that converted the notebook, not the kernel that ran it.")
        report = Report(merged, redact_home=self.redact_home)
        resources["output_extension"] = self.file_extension
        if self.report_format == "json":
            return report.to_json(), resources
        if self.report_format == "md":
            images = {}
            outputs = resources.setdefault("outputs", {})
            for key, (file_name, png) in report.image_files(name).items():
                outputs[file_name] = png  # FilesWriter saves these beside the .md
                images[key] = file_name
            return report.to_markdown(images), resources
        return report.to_html(), resources
