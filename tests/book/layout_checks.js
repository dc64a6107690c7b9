// Layout checks of one page of the built book, run in the browser by test_phone.py.
// The expression evaluates to a promise of {problems: [...], facts: {...}}: each problem is
// one line saying what is wrong and where.
(async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await MathJax.startup.promise;
  }
  await document.fonts.ready;
  await new Promise((done) => requestAnimationFrame(() => requestAnimationFrame(done)));

  const problems = [];
  const vw = document.documentElement.clientWidth;
  const TOL = 1; // px: sub-pixel rounding of layout

  const where = (el) => {
    const parts = [];
    for (let e = el; e && e !== document.body && parts.length < 4; e = e.parentElement) {
      let part = e.tagName.toLowerCase();
      if (e.id) part += "#" + e.id;
      else if (e.classList.length) part += "." + [...e.classList].slice(0, 2).join(".");
      parts.unshift(part);
    }
    const text = (el.textContent || "").replace(/\s+/g, " ").trim().slice(0, 50);
    return parts.join(" > ") + (text ? ` "${text}"` : "");
  };
  const shown = (el) => {
    if (!el.getClientRects().length) return false;
    const cs = getComputedStyle(el);
    return cs.visibility !== "hidden" && cs.display !== "none";
  };
  // An element designated to scroll sideways: its own CSS says overflow-x auto or scroll.
  const scrolls = (el) => ["auto", "scroll"].includes(getComputedStyle(el).overflowX);
  const clips = (el) => getComputedStyle(el).overflowX !== "visible" ||
    getComputedStyle(el).overflowY !== "visible";
  // Inside a closed <dialog> or a hidden sidebar: not on the page.
  const inHidden = (el) => {
    for (let e = el; e; e = e.parentElement) {
      if (e.tagName === "DIALOG" && !e.open) return true;
      const cs = getComputedStyle(e);
      if (cs.visibility === "hidden" || cs.display === "none") return true;
    }
    return false;
  };
  const rectOf = (e) => {
    const r = e.getBoundingClientRect();
    const left = r.left + e.clientLeft, top = r.top + e.clientTop;
    return { left, right: left + e.clientWidth, top, bottom: top + e.clientHeight };
  };
  const cut = (box, r, cs) => ({
    left: Math.max(box.left, r.left),
    right: Math.min(box.right, r.right),
    top: cs.overflowY === "visible" ? box.top : Math.max(box.top, r.top),
    bottom: cs.overflowY === "visible" ? box.bottom : Math.min(box.bottom, r.bottom),
  });
  // Where an element can be seen. reachable: the box a reader can bring into view, cut by
  // the ancestors that clip, up to the nearest scroll container, whose whole scrollable area
  // counts (a scroll container cannot show what overflows its left edge). Not reachable: the
  // box seen without scrolling anything, within the viewport's width.
  const visibleBox = (el, reachable) => {
    let box = { left: -Infinity, right: Infinity, top: -Infinity, bottom: Infinity };
    for (let e = el.parentElement; e && e !== document.documentElement; e = e.parentElement) {
      if (!clips(e)) continue;
      const cs = getComputedStyle(e);
      if (reachable && scrolls(e)) {
        const r = rectOf(e);
        const left = r.left - e.scrollLeft, top = r.top - e.scrollTop;
        return cut(box, { left, right: left + e.scrollWidth, top, bottom: top + e.scrollHeight }, cs);
      }
      box = cut(box, rectOf(e), cs);
    }
    return cut(box, { left: 0, right: vw, top: -Infinity, bottom: Infinity }, { overflowY: "visible" });
  };
  const outside = (r, box) =>
    r.left < box.left - TOL || r.right > box.right + TOL ||
    r.top < box.top - TOL || r.bottom > box.bottom + TOL;

  // 1. Nothing but a scroll container is wider than the viewport, and the page itself does
  // not scroll sideways.
  if (document.documentElement.scrollWidth > vw + TOL) {
    problems.push(`the page scrolls sideways: ${document.documentElement.scrollWidth} px > ${vw} px`);
  }
  const article = document.querySelector("article.bd-article") || document.body;
  const wide = [];
  for (const el of document.body.querySelectorAll("*")) {
    if (!shown(el) || inHidden(el)) continue;
    const r = el.getBoundingClientRect();
    if (r.width === 0 || r.height === 0) continue;
    if (r.right <= vw + TOL && r.left >= -TOL) continue;
    // Past the edge but inside a scroll container that fits: the reader scrolls it.
    let inScroller = false;
    for (let e = el.parentElement; e && e !== document.body; e = e.parentElement) {
      if (scrolls(e)) { inScroller = true; break; }
    }
    if (inScroller) continue;
    // An ancestor that hides what is past the edge makes it cut, which is as bad.
    wide.push(el);
  }
  // Report the outermost offenders only.
  for (const el of wide) {
    if (!wide.includes(el.parentElement)) {
      const r = el.getBoundingClientRect();
      problems.push(`wider than the ${vw} px viewport (${Math.round(r.left)}..${Math.round(r.right)} px): ${where(el)}`);
    }
  }

  // 2. Display equations: the number is in view without scrolling; the equation is either
  // whole in view or in a scroll container. Inline math is never clipped.
  const numbers = [
    ...article.querySelectorAll("div.math span.eqno"),
    ...article.querySelectorAll('mjx-container[display="true"] mjx-labels mjx-mtd, mjx-container[display="true"] mjx-mlabeledtr > mjx-mtd:first-child'),
  ];
  for (const n of numbers) {
    if (!shown(n) || inHidden(n)) continue;
    const r = n.getBoundingClientRect();
    if (r.width === 0) continue;
    if (outside(r, visibleBox(n, false))) {
      problems.push(`equation number out of view (${Math.round(r.left)}..${Math.round(r.right)} px): ${where(n)}`);
    }
  }
  for (const m of article.querySelectorAll("mjx-container")) {
    if (!shown(m) || inHidden(m)) continue;
    const r = m.getBoundingClientRect();
    if (r.width === 0) continue;
    const display = m.getAttribute("display") === "true";
    if (display) {
      // The typeset formula itself (the container may be narrower when it scrolls).
      const math = m.querySelector("mjx-math") || m;
      const rm = math.getBoundingClientRect();
      if (outside(rm, visibleBox(math, true))) {
        problems.push(`display equation cut (${Math.round(rm.left)}..${Math.round(rm.right)} px): ${where(m)}`);
      }
    } else if (outside(r, visibleBox(m, true))) {
      problems.push(`inline math clipped (${Math.round(r.width)}x${Math.round(r.height)} px): ${where(m)}`);
    }
  }

  // 3. Notebook outputs keep their lines: no output line wraps.
  for (const pre of article.querySelectorAll("div.cell_output pre, div.output pre")) {
    if (!shown(pre) || inHidden(pre)) continue;
    const cs = getComputedStyle(pre);
    const text = pre.textContent.replace(/\n$/, "");
    if (!text) continue;
    const lines = text.split("\n").length;
    let lh = parseFloat(cs.lineHeight);
    if (Number.isNaN(lh)) lh = 1.2 * parseFloat(cs.fontSize);
    const height = pre.scrollHeight - parseFloat(cs.paddingTop) - parseFloat(cs.paddingBottom);
    if (height > (lines + 0.5) * lh || !["pre", "nowrap"].includes(cs.whiteSpace.split(" ")[0])) {
      problems.push(`notebook output wrapped: ${lines} lines shown on ${Math.round(height / lh)} (white-space: ${cs.whiteSpace}): ${where(pre)}`);
    }
  }

  // Table cells keep their words whole (the table scrolls instead), and a caption stays in
  // view when its table is scrolled to the end.
  for (const code of article.querySelectorAll("td code.literal, th code.literal")) {
    if (!shown(code) || /\s/.test(code.textContent.trim())) continue;
    if (code.getClientRects().length > 1) {
      problems.push(`a word broken in a table cell: ${where(code)}`);
    }
  }
  for (const caption of article.querySelectorAll("table > caption")) {
    if (!shown(caption) || inHidden(caption)) continue;
    const scroller = caption.closest(".pst-scrollable-table-container");
    for (const end of [0, 1]) {
      if (scroller) scroller.scrollLeft = end * scroller.scrollWidth;
      const r = caption.getBoundingClientRect();
      if (outside(r, visibleBox(caption, false))) {
        problems.push(`table caption out of view (${Math.round(r.left)}..${Math.round(r.right)} px, table scrolled to the ${end ? "end" : "start"}): ${where(caption)}`);
        break;
      }
    }
    if (scroller) scroller.scrollLeft = 0;
  }

  // The arrows of Previous / Next are not cut by their link's box.
  for (const part of document.querySelectorAll(".prev-next-area a > *")) {
    if (!shown(part)) continue;
    const r = part.getBoundingClientRect();
    if (outside(r, visibleBox(part, false))) {
      problems.push(`cut in the Previous/Next footer (${Math.round(r.left)}..${Math.round(r.right)} px): ${where(part)}`);
    }
  }

  // 4. Figures: their width against the text column's.
  const column = article.getBoundingClientRect().width -
    parseFloat(getComputedStyle(article).paddingLeft) -
    parseFloat(getComputedStyle(article).paddingRight);
  const figures = [];
  for (const img of article.querySelectorAll("figure img, div.cell_output img, div.output img")) {
    if (!shown(img) || inHidden(img)) continue;
    figures.push({ where: where(img), width: img.getBoundingClientRect().width, natural: img.naturalWidth });
  }

  // 5. Captions can be read: contrast of their text against white.
  const luminance = (rgb) => {
    const [r, g, b] = rgb.match(/[\d.]+/g).slice(0, 3).map(Number).map((c) => {
      c /= 255;
      return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4;
    });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  let captions = 0, lowest = Infinity;
  for (const cap of article.querySelectorAll("figcaption, caption")) {
    if (!shown(cap) || inHidden(cap)) continue;
    for (const el of [cap, ...cap.querySelectorAll("p, span")]) {
      if (!el.textContent.trim() || el.closest("mjx-container")) continue;
      const ratio = (1.05) / (luminance(getComputedStyle(el).color) + 0.05);
      captions += 1;
      lowest = Math.min(lowest, ratio);
      if (ratio < 7) {
        problems.push(`caption contrast ${ratio.toFixed(1)}:1 (under 7:1): ${where(el)}`);
        break;
      }
    }
  }

  // Sections of the page (for the Contents check) and the buttons of the page header.
  const sections = [...article.querySelectorAll("section > h2")]
    .map((h) => h.parentElement.id).filter(Boolean);
  const counts = {
    numbers: numbers.length,
    math: article.querySelectorAll("mjx-container").length,
    outputs: article.querySelectorAll("div.cell_output pre, div.output pre").length,
    captions,
    lowestCaptionContrast: lowest,
  };
  return { problems, facts: { vw, column, figures, sections, counts } };
})()
