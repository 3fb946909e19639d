"""A Vega-Lite chart that shows itself in JupyterLab and in the static book, with no kernel and no network.

`Chart(spec, name)` displays as two outputs:

1. `application/vnd.vegalite.v5+json` alone: JupyterLab draws it with its own Vega renderer (Vega-Lite 5); the
   book has no renderer for it and leaves it out.
2. `application/javascript` (and a `text/plain` line saying what the chart is): myst-nb writes it into the book
   page as a `<script>` that puts a `<div>` where it stands and draws the spec there with the Vega scripts the book
   serves itself (`book/_vendor/vega/`, copied to `_static/vega/` by `html_static_path`; see the Makefile's vendor
   rule). It never names a URL on the network. JupyterLab runs it too (a trusted output), with no `<script>`
   element: it returns at once.

Two outputs, not one bundle of both: JupyterLab picks one type per output and prefers JavaScript to Vega-Lite when
the notebook is trusted (as after Run All), and the script cannot reach the book's Vega from a notebook server.
Not `text/html`: JupyterLab would prefer it too.

The script works on a page with require.js (the widget manager's loader: the Vega bundles are UMD and would
register as anonymous AMD modules there, so it asks require.js for them by path) and on one without (it adds the
three script tags in order). `Chart.html()` is the same as a `<div>` + `<script>` fragment, for a page of your own.

What this is not: a charting library. Each explorer (footprint.py, timeline.py, plan.py) writes its spec as a dict.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

VEGALITE_MIME = "application/vnd.vegalite.v5+json"
JAVASCRIPT_MIME = "application/javascript"
VEGA_FILES = ("vega.min.js", "vega-lite.min.js", "vega-embed.min.js")  # book/_vendor/vega/, in load order
STATIC_DIR = "_static/vega/"  # where Sphinx's html_static_path puts them, from the book's root
EMBED_OPTIONS = {"mode": "vega-lite", "renderer": "svg",
                 # saving the figure works offline; "open in the Vega editor" would leave the book
                 "actions": {"export": True, "source": False, "compiled": False, "editor": False}}

# Runs where the page puts it: `document.currentScript` is this script. The Vega scripts are loaded once per page
# (window.__minioffloadVega) after the page has parsed, so a require.js the page loads later is seen.
_LOADER = """(function () {
  var here = document.currentScript;
  if (!here) { return; }  // JupyterLab evaluates the script itself (no <script>): it draws the spec output instead
  var box = document.createElement("div");
  box.className = "minioffload-explorer";
  box.setAttribute("data-explorer", %(name)s);
  here.parentNode.insertBefore(box, here);
  var spec = %(spec)s;
  var options = %(options)s;
  function root() {
    var html = document.documentElement;
    var base = html.getAttribute("data-content_root");
    if (base === null && window.DOCUMENTATION_OPTIONS) { base = DOCUMENTATION_OPTIONS.URL_ROOT || ""; }
    return (base || "") + %(static_dir)s;
  }
  function load() {
    if (window.__minioffloadVega) { return window.__minioffloadVega; }
    window.__minioffloadVega = new Promise(function (resolve, reject) {
      var dir = root(), files = %(files)s;
      if (typeof window.define === "function" && window.define.amd && typeof window.require === "function") {
        window.require.config({paths: {"vega": dir + files[0].replace(/\\.js$/, ""),
                                       "vega-lite": dir + files[1].replace(/\\.js$/, ""),
                                       "vega-embed": dir + files[2].replace(/\\.js$/, "")}});
        window.require(["vega-embed"], resolve, reject);
        return;
      }
      (function next(i) {
        if (i === files.length) { resolve(window.vegaEmbed); return; }
        var tag = document.createElement("script");
        tag.src = dir + files[i];
        tag.onload = function () { next(i + 1); };
        tag.onerror = function () { reject(new Error("could not load " + tag.src)); };
        document.head.appendChild(tag);
      })(0);
    });
    return window.__minioffloadVega;
  }
  function draw() {
    load().then(function (embed) {
      return (typeof embed === "function" ? embed : embed["default"])(box, spec, options);
    }).then(function (result) {
      box.minioffloadView = result.view;
      box.setAttribute("data-ready", "true");
    })["catch"](function (err) {
      box.textContent = "This explorer needs the book's Vega scripts (" + root() + "): " + err;
      box.setAttribute("data-ready", "error");
      console.error(err);
    });
  }
  if (document.readyState === "loading") { document.addEventListener("DOMContentLoaded", draw); } else { draw(); }
})();
"""


@dataclass(frozen=True)
class Chart:
    """A Vega-Lite 5 spec (`spec`, a JSON-able dict) and the explorer's name (`name`, e.g. "footprint")."""

    spec: dict
    name: str
    description: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.spec, dict):
            raise TypeError(f"Chart.spec must be a Vega-Lite spec as a dict, got {type(self.spec).__name__}")
        json.dumps(self.spec, allow_nan=False)  # NaN or inf would be invalid JSON in the page: refuse them here

    def script(self) -> str:
        """The JavaScript that draws the chart where it stands in a page (see the module docstring)."""
        text = _LOADER % {"name": json.dumps(self.name), "spec": json.dumps(self.spec, sort_keys=True),
                          "options": json.dumps(EMBED_OPTIONS, sort_keys=True), "static_dir": json.dumps(STATIC_DIR),
                          "files": json.dumps(list(VEGA_FILES))}
        return text.replace("</", "<\\/")  # the spec's strings cannot close the <script> they sit in

    def html(self) -> str:
        """The chart as an HTML fragment: the script in a `<script>` tag (it adds its own `<div>`)."""
        return f'<script type="text/javascript">\n{self.script()}</script>'

    def outputs(self) -> list[dict]:
        """The two outputs the chart displays as: the spec alone (JupyterLab draws it; the book has no renderer for
        it and shows nothing), then the script with a line of text (the book runs the script; JupyterLab runs it too,
        where it finds no <script> of its own and does nothing)."""
        about = f": {self.description}" if self.description else ""
        plain = f"<{self.name} explorer, an interactive Vega-Lite chart{about}>"
        return [{VEGALITE_MIME: self.spec}, {JAVASCRIPT_MIME: self.script(), "text/plain": plain}]

    def _ipython_display_(self) -> None:
        from IPython.display import display

        for bundle in self.outputs():
            display(bundle, raw=True)
