// The page: a thin view over the wasm entry points in src/lib.rs, which run
// the flashattn library (planner, WGSL kernels, reference, accuracy rule).
// With ?selftest it runs every check on load and publishes the results on
// window.flashattnResults for test/browser.mjs.
import init, * as fa from './pkg/flashattn_web.js';

// Odd sizes, causal and not, f32, packed f16 (SwiftShader has no shader-f16)
// and packed bf16.
const SELFTEST_CASES = [
  // Each precision with and without the causal mask, odd sizes (tails of
  // a vec4 and of a tile) and a single row; the native suites run the sizes.
  { seqlen: 1, head_dim: 24, heads: 1, causal: false, precision: 'f32' },
  { seqlen: 113, head_dim: 59, heads: 2, causal: true, precision: 'f32' },
  { seqlen: 37, head_dim: 64, heads: 3, causal: false, precision: 'f16' },
  { seqlen: 113, head_dim: 24, heads: 2, causal: true, precision: 'f16' },
  { seqlen: 1, head_dim: 24, heads: 2, causal: false, precision: 'bf16' },
  { seqlen: 37, head_dim: 59, heads: 2, causal: true, precision: 'bf16' },
  // The registers kernels (GPUs' default natively; browsers plan tiled).
  { seqlen: 113, head_dim: 59, heads: 2, causal: true, precision: 'f32', kernel: 'registers' },
  { seqlen: 37, head_dim: 64, heads: 3, causal: false, precision: 'f16', kernel: 'registers' },
  { seqlen: 113, head_dim: 24, heads: 1, causal: false, precision: 'bf16', kernel: 'registers' },
];
const SEED = 7;
// Every layout a model brings, forward and backward (web/src/lib.rs, layout_case).
const LAYOUT_CASES = [
  { name: 'alibi', precision: 'f32' },
  { name: 'sinks', precision: 'f16' },
  { name: 'block-sparse', precision: 'f32' },
  { name: 'varlen', precision: 'f32' },
  { name: 'varlen', precision: 'f16' },
  { name: 'block-sparse', precision: 'bf16' },
  { name: 'd512', precision: 'f32' },
  { name: 'dv', precision: 'f16' },
  { name: 'dropout', precision: 'f32' },
];

const $ = (id) => document.getElementById(id);
const esc = (s) => String(s).replace(/[&<>]/g, (c) => ({ '&': '&amp;', '<': '&lt;', '>': '&gt;' }[c]));
const exp3 = (x) => (Number.isFinite(x) ? x.toExponential(2) : String(x));
const verdict = (ok) => (ok ? '<span class="ok">✓</span>' : '<span class="bad">FAIL</span>');
const kib = (b) => (b >= 1 << 20 ? `${(b / (1 << 20)).toFixed(0)} MiB` : `${(b / 1024).toFixed(0)} KiB`);

// Progress for test/browser.mjs, which waits as long as checks keep
// finishing: the number of checks this load runs, and those finished.
const progress = { total: 0, finished: 0, last: null };
function finished(what) {
  progress.finished++;
  progress.last = what;
}

function setStatus(text, ok) {
  $('status').textContent = text;
  $('status').className = ok === undefined ? '' : ok ? 'ok' : 'bad';
}

function showDevice(dev, jsInfo) {
  const rows = [
    ['workgroup storage (M)', 'max_compute_workgroup_storage_size', kib],
    ['invocations / workgroup', 'max_compute_invocations_per_workgroup', String],
    ['workgroup size x', 'max_compute_workgroup_size_x', String],
    ['workgroups / dimension', 'max_compute_workgroups_per_dimension', String],
    ['storage binding', 'max_storage_buffer_binding_size', kib],
    ['buffer', 'max_buffer_size', kib],
  ];
  const info = jsInfo ? [jsInfo.vendor, jsInfo.architecture, jsInfo.description].filter(Boolean).join(' · ') : '';
  const name = [dev.adapter, info].filter(Boolean).join(' · ') || 'unnamed adapter';
  $('device').className = '';
  $('device').innerHTML = `
    <div><b>adapter</b> ${esc(name)} <span class="muted">(wgpu backend ${esc(dev.backend)}, device type ${esc(dev.device_type)})</span></div>
    <div><b>features</b> shader-f16: ${dev.shader_f16 ? 'yes' : 'no'}, timestamp-query:
      ${dev.timestamp_query ? 'yes' : 'no'} → f16 inputs use <b>${esc(dev.f16_storage)}</b> storage</div>
    <table style="margin-top:6px"><tr><th>limit</th><th>granted (requested adapter.limits())</th><th>WebGPU default</th></tr>
    ${rows.map(([name, key, f]) => `<tr><td>${name}</td><td>${f(dev.granted[key])}</td><td>${f(dev.webgpu_defaults[key])}</td></tr>`).join('')}
    </table>`;
}

const checkHeads = (r) => r.checks.map((c) => `<th>${c.name}: error ≤ bound</th>`).join('');

function checkCells(r) {
  return r.checks.map((c) => `<td>${exp3(c.max_error)} <span class="muted">≤ ${exp3(c.bound)}</span> ${verdict(c.passed)}</td>`).join('');
}

function showResult(r) {
  $('result').innerHTML = `
    <div class="row"><div><b>forward plan</b><pre>${esc(r.plan.text)}</pre></div>
    <div><b>backward plan</b><pre>${esc(r.backward_plan.text)}</pre></div></div>
    <table><tr><th></th><th>kernel</th><th>with transfers</th><th>GFLOP/s</th><th>CPU backend (wasm)</th></tr>
    <tr><td>forward</td><td>${r.kernel_ms.toFixed(2)} ms</td><td>${r.wall_ms.toFixed(2)} ms</td><td>${r.gflops.toPrecision(3)}</td>
    <td>${r.cpu_ms.toFixed(1)} ms</td></tr>
    <tr><td>backward</td><td>${r.backward_kernel_ms.toFixed(2)} ms</td><td>${r.backward_wall_ms.toFixed(2)} ms</td>
    <td>${r.backward_gflops.toPrecision(3)}</td><td></td></tr></table>
    <table style="margin-top:6px"><tr>${checkHeads(r)}</tr><tr>${checkCells(r)}</tr></table>`;
}

async function runForm(ev) {
  ev.preventDefault();
  $('run').disabled = true;
  $('result').innerHTML = '<span class="muted">running…</span>';
  try {
    const r = JSON.parse(await fa.run_case(
      Number($('seqlen').value), Number($('head_dim').value), Number($('heads').value),
      $('causal').checked, $('precision').value, BigInt(SEED)));
    showResult(r);
  } catch (e) {
    $('result').innerHTML = `<span class="bad">${esc(e.message || e)}</span>`;
  } finally {
    $('run').disabled = false;
  }
}

function showDecode(r) {
  const splits = [...new Set(r.splits)].join(', ');
  $('decode').innerHTML = `
    <table style="margin-top:6px"><tr><th>sequences × start lengths</th><th>pages</th><th>splits used</th>
      <th>per step</th><th>per token</th><th>kernels per step</th><th>tokens/s</th><th>CPU backend (wasm), one step</th></tr>
    <tr><td>${r.batch} × ${r.start_lens.join(' / ')}</td><td>${r.pages} × ${r.page_size}</td>
      <td>${splits} ${r.requested_splits ? `<span class="muted">(asked ${r.requested_splits})</span>` : '<span class="muted">(planner)</span>'}</td>
      <td>${r.step_ms.toFixed(2)} ms</td><td>${r.token_ms.toFixed(2)} ms</td><td>${r.kernel_ms.toFixed(2)} ms</td>
      <td>${r.tokens_per_s.toFixed(0)}</td><td>${r.cpu_step_ms.toFixed(1)} ms</td></tr></table>
    <table style="margin-top:6px"><tr>${checkHeads(r)}<th>|wgpu − cpu|</th><th>cache after the append</th></tr>
    <tr>${checkCells(r)}<td>o ${exp3(r.max_o_diff)}, lse ${exp3(r.max_lse_diff)}</td>
      <td>${r.cache_identical ? 'identical ' : 'DIFFERS '}${verdict(r.cache_identical)}</td></tr></table>
    <div class="muted">averages over ${r.steps} timed steps after one warm-up step; step ${r.checked_step + 1} checked</div>
    <pre>${esc(r.plan)}</pre>`;
}

async function runDecode(ev) {
  if (ev) ev.preventDefault();
  $('dec_run').disabled = true;
  $('decode').innerHTML = '<span class="muted">running…</span>';
  try {
    const r = JSON.parse(await fa.decode_case(
      Number($('dec_len').value), Number($('dec_page').value), Number($('dec_splits').value),
      Number($('dec_steps').value), $('dec_precision').value, BigInt(SEED)));
    showDecode(r);
    return r;
  } catch (e) {
    $('decode').innerHTML = `<span class="bad">${esc(e.message || e)}</span>`;
    throw e;
  } finally {
    $('dec_run').disabled = false;
  }
}

// The self-test's decode runs, through the panel's form: forced splits on odd
// pages in f16 and bf16, then the panel's defaults (the planner), which stay shown.
const DECODE_SELFTEST = [
  { len: 777, page: 7, splits: 3, steps: 4, precision: 'f16' },
  { len: 301, page: 5, splits: 2, steps: 3, precision: 'bf16' },
  { len: 1024, page: 16, splits: 0, steps: 8, precision: 'f32' },
];

function showLayoutChecks(results) {
  $('layoutchecks').innerHTML = `<table class="compact" style="margin-top:6px">
    <tr><th>layout</th><th>dispatches</th><th>checks: error ≤ bound</th></tr>
    ${results.map((r) => `<tr><td>${r.name}, ${r.precision}</td><td>${r.dispatches}</td>
      <td>${r.checks.map((c) => `${c.name} ${exp3(c.max_error)} ${verdict(c.passed)}`).join(' · ')}${
        r.cpu_o_diff == null ? '' : ` · o vs CPU (same seed) ${exp3(r.cpu_o_diff)} ${verdict(r.cpu_o_diff < 1e-4)}`}</td></tr>`).join('')}
    </table>`;
}

// Each kernel family's known-answer check, run before its first call.
function showVerdicts(v) {
  $('verdicts').innerHTML = `<p class="muted">${v.checks_run} checks (verification ${v.mode}), ${v.check_ms.toFixed(0)} ms in all</p>
    <table class="compact"><tr><th>family</th><th>call</th><th>precision</th><th>flags</th><th>verdict</th><th>worst output</th><th>ms</th></tr>
    ${v.known.map((k) => `<tr><td>${k.family}</td><td>${k.call}</td><td>${k.precision}</td><td>${esc(k.flags.join(', '))}</td>
      <td>${verdict(k.verdict === 'verified')} ${k.verdict}</td><td>${esc(k.detail || '')}</td><td>${k.ms.toFixed(0)}</td></tr>`).join('')}
    </table>`;
}

async function runLayoutChecks() {
  const results = [];
  for (const c of LAYOUT_CASES) {
    results.push(JSON.parse(await fa.run_layout_case(c.name, c.precision, BigInt(SEED))));
    showLayoutChecks(results);
    finished(`layout ${c.name} ${c.precision}`);
  }
  return results;
}

async function runDecodeChecks() {
  const runs = [];
  for (const c of DECODE_SELFTEST) {
    $('dec_len').value = c.len;
    $('dec_page').value = c.page;
    $('dec_splits').value = c.splits;
    $('dec_steps').value = c.steps;
    $('dec_precision').value = c.precision;
    runs.push(await runDecode());
    finished(`decode ${c.precision} cache ${c.len}`);
  }
  return runs;
}

function showChecks(results) {
  $('checks').innerHTML = `<table class="compact" style="margin-top:6px">
    <tr><th>case</th><th>fwd Br × Bc</th><th>fwd</th><th>bwd</th>${checkHeads(results[0])}</tr>
    ${results.map((r) => `<tr><td>${r.seqlen} × d ${r.head_dim} × ${r.heads}h, ${r.causal ? 'causal' : 'full'}, ${r.precision}, ${r.kernel}</td>
      <td>${r.plan.br} × ${r.plan.bc}</td><td>${r.kernel_ms.toFixed(1)} ms</td><td>${r.backward_kernel_ms.toFixed(1)} ms</td>
      ${checkCells(r)}</tr>`).join('')}
    </table>`;
}

async function runChecks() {
  $('selftest').disabled = true;
  const results = [];
  try {
    for (const c of SELFTEST_CASES) {
      results.push(JSON.parse(await fa.run_case(c.seqlen, c.head_dim, c.heads, c.causal, c.precision, BigInt(SEED), c.kernel)));
      showChecks(results);
      finished(`case ${c.seqlen} d ${c.head_dim} ${c.precision}${c.kernel ? ` ${c.kernel}` : ''}`);
    }
  } finally {
    $('selftest').disabled = false;
  }
  return results;
}

// A perceptually ordered ramp (approximates viridis) from 0 to 1.
function ramp(t) {
  const stops = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  const x = Math.min(Math.max(t, 0), 1) * (stops.length - 1);
  const i = Math.min(Math.floor(x), stops.length - 2);
  const f = x - i;
  return stops[i].map((a, k) => Math.round(a + (stops[i + 1][k] - a) * f));
}

function drawHeatmap(h) {
  const cell = 9;
  const n = h.seqlen;
  const canvas = document.createElement('canvas');
  canvas.width = canvas.height = n * cell;
  const ctx = canvas.getContext('2d');
  // sqrt makes small probabilities visible next to the large ones.
  const max = Math.sqrt(Math.max(...h.p));
  for (let i = 0; i < n; i++) {
    for (let j = 0; j < n; j++) {
      const [r, g, b] = ramp(Math.sqrt(h.p[i * n + j]) / max);
      ctx.fillStyle = `rgb(${r},${g},${b})`;
      ctx.fillRect(j * cell, i * cell, cell, cell);
    }
  }
  const fig = document.createElement('figure');
  fig.append(canvas);
  const cap = document.createElement('figcaption');
  cap.innerHTML = `${h.causal ? 'causal' : 'no mask'}: rows = queries, columns = keys<br>max |Σ<sub>j</sub> p − 1| = ${exp3(h.max_row_sum_error)}`;
  fig.append(cap);
  $('heatmaps').append(fig);
}

const stepper = { data: null, shown: 0 };

function showSteps() {
  const w = stepper.data;
  const n = stepper.shown;
  const last = w.steps[n - 1];
  const cells = w.scores.map((s, j) => {
    const cls = last && j >= last.keys[0] && j < last.keys[1] ? 'now' : last && j < last.keys[1] ? 'seen' : '';
    return `<div class="cell ${cls}">key ${j}<br>s = ${s.toFixed(3)}<br>v = ${w.v[j]}</div>`;
  }).join('');
  const rows = w.steps.slice(0, n).map((s, i) => `<tr><td>block ${i + 1}: keys ${s.keys[0]}..${s.keys[1] - 1}</td>
    <td>${s.block_max.toFixed(3)}</td><td>${s.alpha.toFixed(4)}</td><td>${s.m.toFixed(3)}</td><td>${s.l.toFixed(4)}</td>
    <td>${s.acc.toFixed(4)}</td><td>${s.o.toFixed(4)}</td></tr>`).join('');
  const done = n === w.steps.length;
  const weights = w.weights.map((x) => x.toFixed(3)).join(', ');
  $('steps').innerHTML = `<div class="cells">${cells}</div>
    <table><tr><th>after</th><th>block max</th><th>α</th><th>m</th><th>l</th><th>Σ e<sup>s−m</sup>v</th><th>O = Σ/l</th></tr>
    <tr><td class="muted">start</td><td></td><td></td><td>−∞</td><td>0</td><td>0</td><td></td></tr>${rows}</table>
    ${done ? `<div class="final">online softmax: O = <b>${w.online_o.toFixed(3)}</b>, lse = ${w.online_lse.toFixed(4)}
      &nbsp;·&nbsp; whole-row softmax (weights ${weights}): O = <b>${w.softmax_o.toFixed(3)}</b>, lse = ${w.softmax_lse.toFixed(4)}
      &nbsp;·&nbsp; WGSL kernel with Bc = ${w.block}: O = <b>${w.gpu_o.toFixed(3)}</b>, lse = ${w.gpu_lse.toFixed(4)}</div>`
    : `<div class="muted final">step ${n} of ${w.steps.length}</div>`}`;
  $('prev').disabled = n === 0;
  $('next').disabled = done;
}

async function loadSteps(block, showAll) {
  stepper.data = JSON.parse(await fa.worked_example(block));
  stepper.shown = showAll ? stepper.data.steps.length : 0;
  showSteps();
  return stepper.data;
}

async function main() {
  const selftest = new URLSearchParams(location.search).has('selftest');
  const results = { done: false, passed: false, error: null, progress };
  // Two heatmaps and three worked examples on every load; the form's run
  // and every case, layout and decoding run with ?selftest.
  progress.total = 2 + 3 + (selftest ? 1 + SELFTEST_CASES.length + LAYOUT_CASES.length + DECODE_SELFTEST.length : 0);
  window.flashattnResults = results;
  try {
    await init();
    // The adapter's own description, when the browser gives one (wgpu's may be terse).
    const adapter = navigator.gpu ? await navigator.gpu.requestAdapter() : null;
    if (!adapter) throw new Error('this browser exposes no WebGPU adapter (navigator.gpu is missing or requestAdapter() returned null)');
    results.device = JSON.parse(await fa.device_info());
    results.device.js_info = adapter.info ? { vendor: adapter.info.vendor, architecture: adapter.info.architecture, description: adapter.info.description } : null;
    showDevice(results.device, results.device.js_info);

    $('form').addEventListener('submit', runForm);
    $('decodeform').addEventListener('submit', (ev) => runDecode(ev).catch(() => {}));
    $('selftest').addEventListener('click', () => runChecks().catch((e) => setStatus(String(e.message || e), false)));
    $('block').addEventListener('change', () => loadSteps(Number($('block').value), false));
    $('next').addEventListener('click', () => { stepper.shown++; showSteps(); });
    $('prev').addEventListener('click', () => { stepper.shown--; showSteps(); });
    $('all').addEventListener('click', () => { stepper.shown = stepper.data.steps.length; showSteps(); });

    results.heatmaps = [];
    for (const causal of [false, true]) {
      const h = JSON.parse(await fa.heatmap(24, 16, causal, BigInt(3)));
      drawHeatmap(h);
      results.heatmaps.push(h);
      finished(`heatmap ${causal ? 'causal' : 'full'}`);
    }
    results.worked = [];
    for (const block of [3, 2, 1]) {
      results.worked.push(await loadSteps(block, selftest));
      finished(`worked example Bc ${block}`);
    }
    $('block').value = '1';
    setStatus('ready', true);

    if (selftest) {
      setStatus('running checks…');
      // The form's default case too, so the page (and its screenshot) shows a plan.
      $('run').click();
      while ($('run').disabled || !$('result').querySelector('pre,.bad')) await new Promise((r) => setTimeout(r, 50));
      const err = $('result').querySelector('.bad');
      if (err) throw new Error(`form run failed: ${err.textContent}`);
      finished('form');
      results.cases = await runChecks();
      results.layouts = await runLayoutChecks();
      results.decode = await runDecodeChecks();
      results.verdicts = JSON.parse(await fa.verdicts());
      showVerdicts(results.verdicts);
      results.passed = results.cases.every((r) => r.passed) && results.layouts.every((r) => r.passed)
        && results.decode.every((r) => r.passed) && results.verdicts.known.every((v) => v.verdict === 'verified');
      setStatus(results.passed ? 'all checks passed' : 'some checks FAILED', results.passed);
    }
  } catch (e) {
    results.error = String(e && e.message ? e.message : e);
    setStatus(`error: ${results.error}`, false);
  } finally {
    results.done = true;
  }
}

main();
