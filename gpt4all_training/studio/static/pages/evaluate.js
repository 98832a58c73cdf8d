// Evaluate: `eval` on the shipped offline suite (configs/eval) for a model before and after training, the scores
// side by side with their 95% intervals and their paired difference.
import {get, runJob} from "../api.js";
import {formatNumber} from "../chart.js";
import {$, busy, el, listing, modelOptions, optionValues, setOptions, showCommand} from "../ui.js";

const interval = bounds => bounds ? `[${formatNumber(bounds[0])}, ${formatNumber(bounds[1])}]` : "-";

// Each score with its 95% interval; with two models the difference, paired on the same examples, its interval and
// verdict (better, worse, no measurable difference).
function table(result) {
  const two = result.models.length === 2;
  const head = el("tr", {}, ...["task", "metric", ...result.models.flatMap((m, i) => [`${two ? ["before", "after"][i]
    : "score"} (${m})`, "95% interval"]), ...(two ? ["difference", "95% interval", "verdict"] : [])]
    .map(h => el("th", {text: h})));
  return [head, ...result.rows.map(row => el("tr", {"data-task": row.task, "data-metric": row.metric},
    el("td", {text: row.task}), el("td", {text: row.metric}),
    ...row.values.flatMap((v, i) => [el("td", {text: formatNumber(v)}), el("td", {text: interval(row.intervals[i])})]),
    ...(two ? [el("td", {class: row.change > 0 ? "up" : row.change < 0 ? "down" : "", text: row.change === null
      ? "-" : (row.change > 0 ? "+" : "") + formatNumber(row.change)}), el("td", {text: interval(row.change_interval)}),
      el("td", {class: {better: "up", worse: "down"}[row.verdict] || "", text: row.verdict || "-"})] : [])))];
}

export function init() {
  $("eval-button").addEventListener("click", event => busy("evaluate", event.target, async () => {
    const models = [$("eval-before").value, $("eval-after").value].filter(Boolean);
    const values = optionValues($("eval-form"));
    const result = await runJob("eval", {...values, models, tasks: values.tasks ?? [], name: $("eval-name").value},
                                job => {
      showCommand("evaluate", job.commands);
      $("eval-log").textContent = job.log.join("\n");
    });
    $("eval-table").replaceChildren(...table(result));
  }));
}

export async function show() {
  const [files, suite] = await Promise.all([listing(), get("/api/eval/tasks")]);
  setOptions($("eval-before"), modelOptions(files), "(none)");
  setOptions($("eval-after"), modelOptions(files));
  if (!$("eval-tasks").children.length) {
    $("eval-tasks").replaceChildren(...suite.tasks.map(task => el("label", {},
      el("input", {type: "checkbox", name: "tasks", "data-list": "", value: task, checked: ""}), ` ${task}`)));
  }
}
