// Loaded before require.js and embed-amd.js on every page that shows widgets
// (_config.yml, nb_ipywidgets_js); tools/fetch_book_js.py copies it to _vendor/.

// The widget modules bundled in embed-amd.js load their icon fonts from beside
// their own module path: tell require.js that these paths are in _vendor/.
var require = (function () {
  var here = document.documentElement.dataset.content_root + "_vendor/html-manager";
  return {paths: {"@jupyter-widgets": here, "@jupyter-widgets/html-manager/dist": here}};
})();

// Widgets typeset their labels with MathJax 2's MathJax.Hub.Queue, which
// MathJax 3 (the book's) does not have: translate, once MathJax has started.
document.addEventListener("DOMContentLoaded", function () {
  var mj = window.MathJax;
  if (!mj || mj.Hub || !mj.startup || !mj.startup.promise) return;
  mj.Hub = {
    Queue: function (command) {
      var element = command && command[2];
      mj.startup.promise.then(function () {
        return element ? mj.typesetPromise([element]) : null;
      }).catch(function (error) { console.warn("MathJax could not typeset a widget label", error); });
    },
  };
});
