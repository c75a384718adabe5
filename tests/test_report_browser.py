"""Open report.html in a real headless browser (Debian's `chromium`) and check that it renders.

Checks: every <img> loaded and decoded (naturalWidth > 0), no JavaScript/console errors,
the screenshot is not a blank page, and the summary cards read "ε" as the browser renders them
(CSS upper-casing would turn it into a capital epsilon, which reads as "E").  The report itself has no script; the test loads a
copy with a small probe script appended, which writes its findings into the DOM that
`--dump-dom` returns.  Skipped, with the reason, when no Chromium is installed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest

from test_report_html import make_run  # noqa: E402  (tests/ is on sys.path under pytest)

from privtune.report import write_report

PROBE = """
<script>
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message || e.type)), true);
window.addEventListener('load', () => {
  const imgs = Array.from(document.images);
  const bad = imgs.filter(i => !(i.complete && i.naturalWidth > 0)).length;
  const out = document.createElement('div');
  out.id = 'probe';
  out.textContent = `images=${imgs.length} broken=${bad} errors=${window.__errors.length} ` +
                    `height=${document.body.scrollHeight}`;
  document.body.appendChild(out);
});
</script>
"""


def _browser() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _run(browser: str, args: list[str], timeout: int = 90) -> subprocess.CompletedProcess:
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
           "--hide-scrollbars", "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", *args]
    env = dict(os.environ, HOME=os.environ.get("HOME", "/tmp"))
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def browser():
    path = _browser()
    if path is None:
        pytest.skip("no Chromium found (install Debian's `chromium` package: apt-get install -y chromium)")
    return path


def test_report_renders_in_headless_chromium(tmp_path, browser):
    run = make_run(tmp_path / "run")
    report = write_report(run)
    probe = run / "report_probe.html"
    probe.write_text(report.read_text().replace("</body>", PROBE + "</body>"))

    dom = _run(browser, ["--dump-dom", probe.as_uri()])
    assert dom.returncode == 0, dom.stderr[-2000:]
    m = re.search(r"images=(\d+) broken=(\d+) errors=(\d+) height=(\d+)", dom.stdout)
    assert m, "probe did not run: " + dom.stdout[-500:]
    images, broken, errors, height = map(int, m.groups())
    # every plot the shareable report holds (budget, strategy, public learning curve; the NOT PRIVATE ones
    # live only in the opt-in report under not_private/) was loaded and decoded
    expected = report.read_text().count("<img ")
    assert expected >= 3 and images == expected and broken == 0 and errors == 0
    assert height > 2000  # a full page, not a blank one
    console = [ln for ln in dom.stderr.splitlines() if "CONSOLE" in ln and ("ERROR" in ln or "Uncaught" in ln)]
    assert not console, console

    shot = tmp_path / "report.png"
    res = _run(browser, [f"--screenshot={shot}", "--window-size=1200,2400", report.as_uri()])
    assert res.returncode == 0 and shot.is_file(), res.stderr[-2000:]
    Image = pytest.importorskip("PIL.Image", reason="pillow is needed to inspect the screenshot").open
    with Image(shot) as img:
        rgb = img.convert("RGB")
        assert rgb.size == (1200, 2400)
        colors = rgb.getcolors(maxcolors=1 << 20) or []
        # a blank page has one or two colours; the report's plots bring hundreds
        assert len(colors) > 200
        # ink (text, plot lines, bars): pixels far from both the page grey and the section white
        def is_background(c):
            return all(abs(a - b) <= 14 for a, b in zip(c, (255, 255, 255))) or all(
                abs(a - b) <= 14 for a, b in zip(c, (245, 246, 248)))

        ink = sum(n for n, c in colors if not is_background(c))
        assert ink > 0.03 * rgb.size[0] * rgb.size[1]
    keep = os.environ.get("PRIVTUNE_KEEP_SCREENSHOT")
    if keep:  # e.g. to refresh the README screenshot: PRIVTUNE_KEEP_SCREENSHOT=docs/report.png
        shutil.copy(shot, keep)


CARD_PROBE = """
<script>
window.addEventListener('load', () => {
  // innerText is the text as rendered: it applies CSS text-transform (upper-casing turns ε into Ε)
  const cards = Array.from(document.querySelectorAll('.card .k')).map(
    el => `${getComputedStyle(el).textTransform}|${el.innerText}`);
  const out = document.createElement('pre');
  out.id = 'cards';
  out.textContent = JSON.stringify(cards);
  document.body.appendChild(out);
});
</script>
"""


def test_summary_cards_show_epsilon_as_rendered(tmp_path, browser):
    import json

    run = make_run(tmp_path / "run")
    report = write_report(run)
    probe = run / "report_cards.html"
    probe.write_text(report.read_text().replace("</body>", CARD_PROBE + "</body>"))
    dom = _run(browser, ["--dump-dom", probe.as_uri()])
    assert dom.returncode == 0, dom.stderr[-2000:]
    m = re.search(r'<pre id="cards">(.*?)</pre>', dom.stdout, re.S)
    assert m, "probe did not run: " + dom.stdout[-500:]
    cards = [c.split("|", 1) for c in json.loads(m.group(1).replace("&amp;", "&"))]
    rendered = {text for _, text in cards}
    assert {"ε (total)", "δ", "ledger: ε left"} <= rendered, cards
    assert all(transform == "none" for transform, _ in cards), cards
    assert not any("Ε" in text or "Δ" in text for text in rendered), cards  # capital epsilon / delta
