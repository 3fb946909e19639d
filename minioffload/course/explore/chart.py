"""A Vega-Lite chart that shows itself in JupyterLab and in the static book, with no kernel and no network.

`Chart(spec, name)` displays as:

* `application/vnd.vegalite.v5+json`: JupyterLab draws it with its own Vega renderer (Vega-Lite 5);
* `application/javascript`: myst-nb writes it into the book page as a `<script>` that puts a `<div>` where it
  stands and draws the spec there with the Vega scripts the book serves itself (`book/_vendor/vega/`, copied to
  `_static/vega/` by `html_static_path`; see the Makefile's vendor rule). It never names a URL on the network.
  Not `text/html`: JupyterLab ranks HTML above Vega-Lite and would show the HTML, which cannot reach the book's
  scripts from a notebook server; it ranks JavaScript below Vega-Lite (and runs none in outputs).
* `text/plain`: one line saying what the chart is.

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

    def _repr_mimebundle_(self, include=None, exclude=None) -> dict:
        about = f": {self.description}" if self.description else ""
        plain = f"<{self.name} explorer, an interactive Vega-Lite chart{about}>"
        return {VEGALITE_MIME: self.spec, JAVASCRIPT_MIME: self.script(), "text/plain": plain}
