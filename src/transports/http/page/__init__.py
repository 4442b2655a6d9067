"""The web chat page (``page``) and its assets (``web/``: the HTML, its scripts, the vendored
libraries), shipped as package data."""
