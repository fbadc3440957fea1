"""mkdocs hooks for the documentation site (mkdocs.yml names this file).

Docstrings cross-reference in the Sphinx manner (``:class:`~xlatrain.config.TrainConfig```), which
reads well in ``help()``; mkdocstrings' Google-style renderer leaves the role as literal text. Each
role becomes a cross-reference that mkdocs-autorefs resolves to the page documenting the name, or
plain code where no page does: ``~`` shows the last part of the name only, as in Sphinx.
"""

from __future__ import annotations

import re
from typing import Any

ROLE = re.compile(r":(?:class|mod|func|meth|attr|data|exc|obj):<code>(~?)([\w.]+)</code>")


def on_page_content(html: str, **_: Any) -> str:
    def ref(match: re.Match[str]) -> str:
        short, name = match.groups()
        shown = name.rsplit(".", 1)[-1] if short else name
        return f'<autoref identifier="{name}" optional><code>{shown}</code></autoref>'

    return ROLE.sub(ref, html)
