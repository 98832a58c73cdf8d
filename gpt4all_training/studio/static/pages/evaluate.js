// Evaluate: `eval` on the shipped offline suite (configs/eval) for a model before and after training, the scores
// side by side with their difference.
import {get, runJob} from "../api.js";
import {formatNumber} from "../chart.js";
import {$, busy, el, listing, setOptions, showCommand} from "../ui.js";

function table(result) {
  const two = result.models.length === 2;
  const head = el("tr", {}, ...["task", "metric", ...result.models.map((m, i) => `${two ? ["before", "after"][i]
    : "score"} (${m})`), ...(two ? ["difference"] : [])].map(h => el("th", {text: h})));
  return [head, ...result.rows.map(row => el("tr", {"data-task": row.task, "data-metric": row.metric},
    el("td", {text: row.task}), el("td", {text: row.metric}),
    ...row.values.map(v => el("td", {text: formatNumber(v)})),
    ...(two ? [el("td", {class: row.change > 0 ? "up" : row.change < 0 ? "down" : "", text: row.change === null
      ? "-" : (row.change > 0 ? "+" : "") + formatNumber(row.change)})] : [])))];
}

export function init() {
  $("eval-button").addEventListener("click", event => busy("evaluate", event.target, async () => {
    const models = [$("eval-before").value, $("eval-after").value].filter(Boolean);
    const tasks = [...document.querySelectorAll("#eval-tasks input:checked")].map(i => i.value);
    const limit = $("eval-limit").value ? Number($("eval-limit").value) : null;
    const result = await runJob("eval", {models, tasks, name: $("eval-name").value, limit}, job => {
      showCommand("evaluate", job.commands);
      $("eval-log").textContent = job.log.join("\n");
    });
    $("eval-table").replaceChildren(...table(result));
  }));
}

export async function show() {
  const [files, suite] = await Promise.all([listing(), get("/api/eval/tasks")]);
  setOptions($("eval-before"), files.models, "(none)");
  setOptions($("eval-after"), files.models);
  if (!$("eval-tasks").children.length) {
    $("eval-tasks").replaceChildren(...suite.tasks.map(task => el("label", {},
      el("input", {type: "checkbox", value: task, checked: ""}), ` ${task}`)));
  }
}
