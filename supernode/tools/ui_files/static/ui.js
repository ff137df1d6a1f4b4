// Live refresh: every element with data-refresh is fetched again (the server renders the same fragment)
// and replaced when it changed, keeping the focused element focused (by its id).
(function () {
  "use strict";
  const PERIOD_MS = 2000;
  function refresh(el) {
    fetch(el.dataset.refresh, { credentials: "same-origin", headers: { "Accept": "text/html" } })
      .then((r) => (r.ok ? r.text() : null))
      .then((html) => {
        if (html === null || html === el.dataset.last) return;
        el.dataset.last = html;
        const focused = document.activeElement && el.contains(document.activeElement) ? document.activeElement.id : null;
        el.innerHTML = html;
        if (focused) { const again = document.getElementById(focused); if (again) again.focus(); }
        tailLogs(el);
      })
      .catch(() => {});
  }
  // A log shows its newest lines: scrolled to its end.
  function tailLogs(root) {
    root.querySelectorAll("pre.log").forEach((pre) => { pre.scrollTop = pre.scrollHeight; });
  }
  document.addEventListener("DOMContentLoaded", () => {
    tailLogs(document);
    const els = document.querySelectorAll("[data-refresh]");
    if (els.length) setInterval(() => els.forEach(refresh), PERIOD_MS);
  });
})();
